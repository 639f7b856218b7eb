"""The single controller: resource manager, program registry, planner, object
directory, and the socket loop that carries out their decisions."""
