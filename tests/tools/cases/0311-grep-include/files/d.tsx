match
