"""The admin API: adapters (upload, register, load, evict, pin, delete), aliases, tenant keys
and the audit log; every route behind the admin key."""
