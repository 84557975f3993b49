"""Does SAM (plain, warm-started, adaptive) beat SGD on real networks, how sensitive is it to rho, and does the detector fire there?

SGD against SAM, SAM after a warm-start of plain steps, and ASAM, over a
grid of rho and seeds, on digits and 5,000 MNIST images (clean and with
symmetric label noise) and on the in-project LM; with the hallucination
detector's statistics and a stall measure for every run (README.md).
"""
