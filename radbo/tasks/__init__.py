"""Bilevel tasks: concrete inner/outer losses."""

from radbo.tasks.hyper_representation import HyperRepresentation

__all__ = ["HyperRepresentation"]
