"""Tests of radbo.experiment."""
