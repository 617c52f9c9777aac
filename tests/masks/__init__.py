"""Tests of radbo.masks."""
