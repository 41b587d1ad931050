//! The layer.

use tower::Layer;

use super::{MetaSchema, MetaSchemaService};

/// Applies [`MetaSchemaService`] with one [`MetaSchema`] (shared, not copied) to services.
#[derive(Clone, Debug)]
pub struct MetaSchemaLayer {
    schema: MetaSchema,
}

impl MetaSchemaLayer {
    /// A layer checking against `schema`.
    pub fn new(schema: MetaSchema) -> MetaSchemaLayer {
        MetaSchemaLayer { schema }
    }
}

impl<S> Layer<S> for MetaSchemaLayer {
    type Service = MetaSchemaService<S>;

    fn layer(&self, inner: S) -> MetaSchemaService<S> {
        MetaSchemaService::new(inner, self.schema.clone())
    }
}
