"""Spec-Bench harness: questions.py (load/select), methods.py (name -> runner registry),
runner.py (interleaved timing, aggregation), report.py (JSON, markdown, tables), cli.py (`polybasic bench`)."""
