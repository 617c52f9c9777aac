"""Tests of radbo.export."""
