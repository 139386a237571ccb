"""Tests for calc.py. Run with: python3 -m unittest -v"""

import unittest

import calc


class TotalTest(unittest.TestCase):
    def test_total(self):
        self.assertEqual(calc.total([1, 2, 3]), 6)

    def test_total_empty(self):
        self.assertEqual(calc.total([]), 0)


class MeanTest(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(calc.mean([2, 4, 6]), 4)

    def test_mean_single(self):
        self.assertEqual(calc.mean([5]), 5)

    def test_mean_empty(self):
        with self.assertRaises(ValueError):
            calc.mean([])


class SpreadTest(unittest.TestCase):
    def test_spread(self):
        self.assertEqual(calc.spread([3, 9, 1]), 8)


class ClampTest(unittest.TestCase):
    def test_inside(self):
        self.assertEqual(calc.clamp(5, 0, 10), 5)

    def test_outside(self):
        self.assertEqual(calc.clamp(-3, 0, 10), 0)
        self.assertEqual(calc.clamp(12, 0, 10), 10)

    def test_bad_range(self):
        with self.assertRaises(ValueError):
            calc.clamp(1, 5, 0)


if __name__ == "__main__":
    unittest.main()
