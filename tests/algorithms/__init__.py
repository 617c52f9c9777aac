"""Tests of radbo.algorithms."""
