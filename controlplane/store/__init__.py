"""The SQL store: SQLAlchemy 2 models, the writer the loop uses, read-only queries, migrations.

All SQL in the project lives in this package and in `migrations/`.
"""
