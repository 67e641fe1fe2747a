"""How much to speculate: the cost profile, its calibration and the tree planner."""
