"""Reading the autograd graph: the walk from the roots, hooks, saved state, releasing it, sparse layouts."""
