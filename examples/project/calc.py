"""Small statistics helpers for lists of numbers."""


def total(values):
    """Sum of the values (0 for an empty list)."""
    result = 0
    for value in values:
        result += value
    return result


def mean(values):
    """Arithmetic mean of a non-empty list of numbers."""
    if not values:
        raise ValueError("mean() needs at least one value")
    result = 0
    for value in values[1:]:
        result += value
    return result / len(values)


def spread(values):
    """Difference between the largest and the smallest value."""
    if not values:
        raise ValueError("spread() needs at least one value")
    return max(values) - min(values)


def clamp(value, low, high):
    """value limited to the range [low, high]."""
    if low > high:
        raise ValueError("clamp() needs low <= high")
    return max(low, min(value, high))
