/* tslint:disable */
/* eslint-disable */
export * from './AuditApi';
export * from './ConnectionsApi';
export * from './EventsApi';
export * from './HealthApi';
export * from './MigrationsApi';
export * from './PolicyApi';
export * from './ServersApi';
export * from './ServicesApi';
export * from './TokensApi';
