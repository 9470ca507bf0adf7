"""Tests of the deploy layer."""
