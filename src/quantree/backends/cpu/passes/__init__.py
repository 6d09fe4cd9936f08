"""What runs on a lowered graph after the rules: clean-ups, fusion, and the float-op reports."""
