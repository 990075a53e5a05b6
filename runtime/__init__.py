"""vjpgen runtime: helpers the generated formulas call, graph capture and compilation."""
