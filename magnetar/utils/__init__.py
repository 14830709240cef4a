"""Small shared utilities below every layer: NVTX ranges, section timing, Magnetar weights files, the
registries' lazy class loader."""
