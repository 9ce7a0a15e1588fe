"""Scheduling: which group is generated, trained or dropped, and when; one module per rule.

- `staleness.py`: the staleness rule as numbers (groups allowed in play, the oldest trainable version).
- `groups.py`: `GroupSchedule`, a group's life (issue, submitted, trained, dropped, expired, taken over,
  resumed) and the only place staleness capacity is claimed or given back.
- `ledger.py`: the prompt ledger on Redis (which prompt each group answers, who holds it, how it ended)
  and the prompt order (seeded shuffles per epoch).
- `buffer.py`: scored samples assembled into groups, and the learner's batch chosen from them (stale,
  unusable and, if asked, zero-advantage groups dropped).
"""
