"""Tests of the training layer."""
