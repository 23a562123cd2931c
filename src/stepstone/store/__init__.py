"""The only package that speaks SQL: connections, migrations, queries and driver-error translation."""
