"""A float64 numpy reference of the sampling pipeline, written from vLLM's definitions (not from
our code), for the sampling tests: min_tokens masking and penalties on the raw logits, then the
temperature, min-p, top-k, top-p; logprobs of the raw logits.

float32 on the device may decide a token the other way when it sits within float32 error of a
threshold: ``hot_process`` reports such tokens as ambiguous, and the tests leave those rows out
(and check that they are rare)."""

from __future__ import annotations

import numpy as np

EPS = 2e-5  # a decision this close to its threshold may go either way in float32


def raw_process(logits, prompt, output, p, eos=()) -> np.ndarray:
    """min_tokens masking, logit_bias (added), then repetition, frequency and presence penalties
    (vLLM's ``apply_penalties``: repetition on prompt + output tokens, the others on output tokens)."""
    x = np.array(logits, np.float64)
    V = len(x)
    if len(output) < p.min_tokens:
        stop = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
        x[sorted(stop)] = -np.inf
    for t, b in getattr(p, "logit_bias", ()):
        x[t] += b
    counts = np.bincount(np.asarray(output, np.int64), minlength=V).astype(np.float64)
    seen = (counts > 0) | (np.bincount(np.asarray(prompt, np.int64), minlength=V) > 0)
    rep = np.where(seen, p.repetition_penalty, 1.0)
    x = np.where(x > 0, x / rep, x * rep)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def hot_process(x: np.ndarray, p) -> tuple[np.ndarray, bool]:
    """Temperature, then min-p, top-k, top-p: the logits a hot row draws from (-inf outside the
    support), and whether some decision was within ``EPS`` of its threshold."""
    y = np.array(x, np.float64) / p.temperature
    ambiguous = False
    if p.min_p > 0:
        pr = softmax(y)
        threshold = p.min_p * pr.max()
        ambiguous |= bool((np.abs(pr - threshold) < EPS * threshold).any())
        y[pr < threshold] = -np.inf
    if 0 < p.top_k < len(y):
        kth = np.sort(y)[::-1][p.top_k - 1]
        if np.isfinite(kth):  # else min-p left fewer than k tokens: nothing to cut
            ambiguous |= int((np.abs(y - kth) < EPS).sum()) > 1
        y[y < kth] = -np.inf
    if p.top_p < 1:
        order = np.argsort(y, kind="stable")
        cs = np.cumsum(softmax(y[order]))
        drop = cs <= 1 - p.top_p
        drop[-1] = False
        ambiguous |= bool((np.abs(cs - (1 - p.top_p))[np.isfinite(y[order])] < EPS).any())
        y[order[drop]] = -np.inf
    return y, ambiguous


def log_softmax(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def chi2_critical(dof: int, z: float = 3.719) -> float:
    """The chi-square value exceeded with probability ~1e-4 (z = 3.719), by Wilson-Hilferty."""
    k = float(dof)
    return k * (1 - 2 / (9 * k) + z * (2 / (9 * k)) ** 0.5) ** 3
