"""Statistics and plots for reports (intervals, paired tests, curves)."""
