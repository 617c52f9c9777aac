"""Tests of radbo.models."""
