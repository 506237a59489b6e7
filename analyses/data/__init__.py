"""Prompts, tasks, batches and metrics, and the statistics every study shares (bootstrap intervals, split-half
stability); the data files they read live here too. Imports only ``interp`` and ``hooks``: every other room of
``analyses`` builds on this one.
"""
