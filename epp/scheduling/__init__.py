"""Filters -> weighted scorers -> picker, configured like GIE's EndpointPickerConfig."""
