"""Integrations of the registry with inference stacks: mlx-lm models and a slot-pool engine."""
