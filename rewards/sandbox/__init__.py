"""The code sandbox behind the `code_tests` reward (`rlplatform.rewards.code_sandbox`): `child.py` is
the bootstrap of its two child interpreters, run as a script, which imports its siblings by their
plain names (`jail`: the isolation; `solution`: runs the code under an audit hook; `judge`: runs the
tests against the values the code returned; `wire`: the typed values between them). Only `jail` is
also imported as part of the package, for its limits."""
