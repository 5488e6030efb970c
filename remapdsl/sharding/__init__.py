"""Placements and meshes -> the boxes a rank holds; compiled blocks + boxes -> frozen per-rank plans."""
