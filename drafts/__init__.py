"""Shallow drafts built from the target itself, and their profile.

Following "Decoding Speculative Decoding" (Yan et al., NAACL 2025): a draft's *latency* matters
more than its language-modelling quality, so a draft made of a few of the target's own layers,
distilled on the target's own text, can beat a bigger, better draft.

- `shallow`: pick layers of the target and copy them (and the shared embeddings / head) into a
  smaller model of the same architecture.
- `data`: text the target writes itself (prompts it invents, or a given set, and its answers),
  with the target's top-k next-token distributions, generated once and cached.
- `distill`: forward KL on the target's top-k distribution (plus the tail mass), within a time
  budget, with checkpoints and resume.
- `build`: the whole `specdec draft build`, writing a loadable model directory and a report.
- `profile`: step latency, acceptance on held-out prompts and end-to-end speedup per candidate.
- `cli`: the `specdec draft` subcommands.
"""
