/*
 * checkpoint.cpp -- the part of torch.compile's cudagraph trees support that
 * needs torch's C++ types: swapping the deleters of storages when a checkpoint
 * of a graph pool is restored (torch._C._cuda_setCheckpointPoolState).
 *
 * gpumem.torch builds this file against the installed torch on first use (the
 * way inductor compiles its own C++), links it to libc10 only, and calls it
 * through ctypes.  Everything else about pools lives in gpumem._C, which is
 * built without torch.
 *
 * Storages come as StorageImpl addresses (what cudagraph trees passes).  A
 * storage given gpumem's deleter here is one torch's own helpers
 * (_free_And_Remove_DeleterFn, _has_Standard_Deleter) do not recognise, so
 * gpumem.torch answers those for it too.
 */
#include <c10/core/Device.h>
#include <c10/core/StorageImpl.h>

#include <cstddef>
#include <cstdint>
#include <unordered_set>

#ifndef GM_TORCH_VERSION
#error "build with -DGM_TORCH_VERSION=\"<torch.__version__>\""
#endif

extern "C" {

/* The torch this file was built against (torch.__version__). */
__attribute__((visibility("default"))) const char *gm_ckpt_torch_version(void) { return GM_TORCH_VERSION; }

/* The c10 StorageImpl layout this file was compiled against: gpumem.torch
 * compares it with the torch it runs under before using the library. */
__attribute__((visibility("default"))) size_t gm_ckpt_storage_impl_size(void) { return sizeof(c10::StorageImpl); }

/* Give each storage (whose block the restored checkpoint allocated again) a
 * DataPtr that frees through `deleter` (gpumem's raw delete).  Returns the
 * index of the first storage whose address is not in allocd, or -1. */
__attribute__((visibility("default"))) long gm_ckpt_add_deleters(const uint64_t *storages, size_t n,
                                                                 const uint64_t *allocd, size_t n_allocd,
                                                                 void (*deleter)(void *), int device) {
    std::unordered_set<uint64_t> ok(allocd, allocd + n_allocd);
    for (size_t i = 0; i < n; i++) {
        auto *s = reinterpret_cast<c10::StorageImpl *>(storages[i]);
        if (!ok.count((uint64_t)(uintptr_t)s->data_ptr().get())) return (long)i;
    }
    for (size_t i = 0; i < n; i++) {
        auto *s = reinterpret_cast<c10::StorageImpl *>(storages[i]);
        void *p = s->data_ptr().get();
        s->set_data_ptr_noswap(
            c10::DataPtr(p, p, deleter, c10::Device(c10::DeviceType::CUDA, (c10::DeviceIndex)device)));
    }
    return -1;
}

/* Stale storages whose block the checkpoint freed: drop their deleter so that
 * they never free it again (torch's removeStorageDeleterFns). */
__attribute__((visibility("default"))) void gm_ckpt_release_deleters(const uint64_t *storages, size_t n,
                                                                     const uint64_t *freed, size_t n_freed) {
    std::unordered_set<uint64_t> gone(freed, freed + n_freed);
    for (size_t i = 0; i < n; i++) {
        auto *s = reinterpret_cast<c10::StorageImpl *>(storages[i]);
        c10::DataPtr &dp = s->mutable_data_ptr();
        if (gone.count((uint64_t)(uintptr_t)dp.get())) dp.release_context();
    }
}

/* torch._C._free_And_Remove_DeleterFn for a storage whose deleter is gpumem's
 * (one a checkpoint restore gave it): swap it for deleteNothing and free the
 * block.  Returns 0 when the storage has another deleter (nothing changed). */
__attribute__((visibility("default"))) int gm_ckpt_free_and_remove(uint64_t storage, void (*deleter)(void *)) {
    auto *s = reinterpret_cast<c10::StorageImpl *>(storage);
    void *p = s->data_ptr().get();
    if (!s->mutable_data_ptr().compare_exchange_deleter(deleter, c10::detail::deleteNothing)) return 0;
    deleter(p);
    return 1;
}

/* Whether the storage frees through `deleter` (torch._C._has_Standard_Deleter). */
__attribute__((visibility("default"))) int gm_ckpt_has_deleter(uint64_t storage, void (*deleter)(void *)) {
    return reinterpret_cast<c10::StorageImpl *>(storage)->data_ptr().get_deleter() == deleter;
}

} // extern "C"
