"""Tests of radbo.tasks."""
