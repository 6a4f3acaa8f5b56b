"""What a user sees: the `nightshift` commands, the live view, review tables, the HTML report."""
