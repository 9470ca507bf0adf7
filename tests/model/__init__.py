"""Tests of the model layer."""
