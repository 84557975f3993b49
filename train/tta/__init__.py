"""Test-time adaptation (source, BN statistics, TENT, EATA, SAR) with a fixed rate or CONGA."""
