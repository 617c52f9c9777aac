"""Tests of radbo.devices."""
