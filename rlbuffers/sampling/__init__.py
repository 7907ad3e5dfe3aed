"""Samplers: index policies that choose slots and never read transition data (uniform,
prioritized with its sum tree, sequence windows, whole groups) and the state they share."""
