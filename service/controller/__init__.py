"""How much to speculate: the cost profile, its calibration, the tree planner and the step's
policy."""
