"""Native ops that run a pattern of several reference ops as one kernel call (the ops of
``rules/composite/`` and of the passes that match a block): float attention."""
