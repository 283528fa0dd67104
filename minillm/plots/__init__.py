"""Figures for the chapter, all saved through ``minillm.plots.figures`` (PNG + SVG + data)."""
