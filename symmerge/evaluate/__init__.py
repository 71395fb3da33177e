"""Did a fusion work? Loss and accuracy, interpolation curves and barriers, distance tables, plots."""
