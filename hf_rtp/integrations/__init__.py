"""Small compatibility shims for libraries that inspect models (applied only when they are installed)."""
