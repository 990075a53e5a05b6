"""The one executor: the step loop, a region's lookup, key, function and call, live steps, leaves,
graph breaks found at run time."""
