"""How each node runs: the kernel that serves it, the one rule table (``decide``), the frozen plan."""
