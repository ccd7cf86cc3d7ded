/* A workaround for PoCL 5.x and 6.x building kernels that use barriers wrong at random (README:
   known limitations; tools/pocl_vua_repro.py shows it): preloaded, free() holds each small block
   (up to SMALL bytes) back until QUARANTINE later frees of the same thread, so that an address
   freed while PoCL's kernel compiler builds a work-group function is not handed out again within
   that build. That compiler keeps its uniformity results keyed by llvm::Value address and never
   drops the entries of deleted values: a new instruction placed at such an address inherits the
   stale result, and a varying value taken for uniform gets no copy per work-item.

       python -m clops pocl-quarantine   (or: cc -O2 -shared -fPIC -o q.so pocl_free_quarantine.c -ldl)
       LD_PRELOAD=<the library it built> python ...

   clops then no longer warns about the fault (clops.runtime.QUARANTINED). It costs memory (at
   most QUARANTINE blocks of SMALL bytes a thread) and some speed (tests/test_attention_bwd.py took 88 s
   under PoCL 5.0 with it, against 50 s without). The attention tests under PoCL 5.0 passed with 2^16 blocks
   held back and failed with 2^14 (fewer held back can make the fault more frequent). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <malloc.h>
#include <pthread.h>
#include <stddef.h>

#define QUARANTINE (1 << 18)
#define SMALL 1024

static __thread void *ring[QUARANTINE];
static __thread size_t head;
static __thread int resolving;
static void (*real_free)(void *);
static pthread_key_t at_exit;
static pthread_once_t once = PTHREAD_ONCE_INIT;

/* clops looks this symbol up to know the quarantine is in place. */
void pocl_free_quarantine(void) {}

static void release_ring(void *unused)
{
    (void)unused;
    for (size_t i = 0; i < QUARANTINE; ++i)
        if (ring[i]) {
            real_free(ring[i]);
            ring[i] = NULL;
        }
}

static void make_key(void) { pthread_key_create(&at_exit, release_ring); }

void free(void *p)
{
    if (!p)
        return;
    if (!real_free) {
        if (resolving)
            return; /* a free inside dlsym: leaked, once */
        resolving = 1;
        real_free = (void (*)(void *))dlsym(RTLD_NEXT, "free");
        resolving = 0;
    }
    if (malloc_usable_size(p) > SMALL) {
        real_free(p);
        return;
    }
    if (head == 0 && !ring[0]) { /* this thread's first block: release its ring when it ends */
        pthread_once(&once, make_key);
        pthread_setspecific(at_exit, ring);
    }
    void *old = ring[head];
    ring[head] = p;
    head = (head + 1) % QUARANTINE;
    if (old)
        real_free(old);
}
