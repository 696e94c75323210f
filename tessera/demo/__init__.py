"""Generators, training and evaluation scripts for the bundled demo models."""
