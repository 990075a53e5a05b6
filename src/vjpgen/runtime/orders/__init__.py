"""Every derivative order from vjpgen's kernels: the joint through the executor, the stages that build a
differentiable compiled graph, the graph itself, the runtime's ``create_graph`` regions."""
