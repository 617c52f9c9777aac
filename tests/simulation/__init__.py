"""Tests of radbo.simulation."""
