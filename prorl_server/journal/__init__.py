"""The durable journal of a rollout server and what reads it back.

- :mod:`~prorl_server.journal.store`: the SQLite (WAL) journal a server writes (jobs, results, completions,
  gateway exchanges);
- :mod:`~prorl_server.journal.regrade`: re-grading stored trajectories with the current handler code;
- :mod:`~prorl_server.journal.export`: a journal's trajectories as verl rows, TRL rows or JSONL;
- :mod:`~prorl_server.journal.cli`: the ``prorl-journal`` command (regrade, export, stats).
"""
