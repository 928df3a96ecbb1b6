"""The decode node server: KV admission and reception, continuous-batching decode over the
paged latent cache, MTP speculation, the overlapped step; expert-parallel ranks (`ranks`)."""
