"""Region features (SPEC §2): the canonical per-image record, the HDF5 store, and the file formats.

- `record`    `RegionRecord` (one image's boxes, features, detector outputs) and `StoreMetadata`
- `store`     `RegionStoreWriter` / `RegionStore` / `write_store_records`: the canonical HDF5 store
- `tsv`       BUTD 6-field and LXMERT 10-field TSV readers and writers
- `importers` `import_features` (TSV -> store, streaming) and `export_tsv` (store -> TSV)

Nothing is imported here so that `import vlberts.features.<module>` stays cheap.
"""
