"""Tests of radbo.hypergrad."""
