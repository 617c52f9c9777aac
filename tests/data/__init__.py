"""Tests of radbo.data."""
