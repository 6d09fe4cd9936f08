"""Sharing groups: the union-find over Values and Uses, groups formed at prepare, their
parameters at convert."""
