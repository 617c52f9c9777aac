"""Tests of radbo.flower."""
