"""Make audit_entries append-only on PostgreSQL: a trigger refuses every UPDATE and
DELETE of its rows, whatever the role (SQLite, the embedded default, has no such
guard). TRUNCATE is left to the table's owner (tests flush with it); a deployment
that wants more runs the application under a role that does not own the table
(docs/platform-admins.md#audit-trail)."""

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

CREATE = """
CREATE OR REPLACE FUNCTION audit_entries_refuse_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit_entries is append-only: % refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END
$$;
CREATE TRIGGER audit_entries_append_only
    BEFORE UPDATE OR DELETE ON audit_entries
    FOR EACH ROW EXECUTE FUNCTION audit_entries_refuse_change();
"""

DROP = """
DROP TRIGGER IF EXISTS audit_entries_append_only ON audit_entries;
DROP FUNCTION IF EXISTS audit_entries_refuse_change();
"""


def create_trigger(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE, params=None)


def drop_trigger(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP, params=None)


class Migration(migrations.Migration):
    dependencies = [("audit", "0001_initial")]

    operations = [migrations.RunPython(create_trigger, drop_trigger)]
